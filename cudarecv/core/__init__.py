"""What every layer stands on: errors, checks, the tag space, peer resolution, posting and parking,
the transfer future and its exit hook, per-peer threads, streams and events, host copies.
Imports nothing of cudarecv above it.
"""
