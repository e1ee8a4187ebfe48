"""Weight sync's transports: the routes a version takes from a sender's snapshot to a receiver (the wire, host
shared memory, CUDA IPC) behind one interface (:class:`~.base.Transport`), chosen in one place
(:mod:`.registry`)."""
