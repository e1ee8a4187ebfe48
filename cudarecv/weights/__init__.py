"""Weight sync: :class:`WeightSender` and :class:`WeightReceiver`, their wire and the relay."""
