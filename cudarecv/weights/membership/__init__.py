"""Weight sync without a process group shared by all: receivers join a named sender through a store
(:class:`~cudarecv.ElasticSender` in :mod:`.elastic_sender`, :class:`~cudarecv.ElasticReceiver` in
:mod:`.elastic_receiver`)."""
