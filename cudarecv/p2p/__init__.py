"""The drop-in calls: ``isend/irecv/send/recv`` and ``install()``, and stock tensordict's own."""
