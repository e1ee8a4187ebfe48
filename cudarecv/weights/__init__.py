"""Weight sync: :class:`~cudarecv.WeightSender` and :class:`~cudarecv.WeightReceiver` (ranks of a process group),
:class:`~cudarecv.ElasticSender` and :class:`~cudarecv.ElasticReceiver` (joined through a store, by name:
:mod:`.membership`), :class:`~cudarecv.ShardedSender` and :class:`~cudarecv.ShardedReceiver` (DTensors or slices:
:mod:`.sharded`); their wire and the relay."""
