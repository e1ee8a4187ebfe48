"""Sharded weight sync: a sender of several ranks holding DTensor shards (an FSDP2 trainer), receivers of any
layout. Each pair moves the overlap of what the sender rank holds and the receiver wants, computed at the
handshake from both layouts (:mod:`~cudarecv.weights.sharded.layout`); nothing is gathered. The public API is
:class:`~cudarecv.ShardedSender` (:mod:`.sharded_sender`) and :class:`~cudarecv.ShardedReceiver`
(:mod:`.sharded_receiver`)."""
