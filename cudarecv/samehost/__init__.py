"""Same-host transports beneath the fast wire: shared memory, CUDA IPC, direct reads, and the
negotiation of a link direction. Above :mod:`cudarecv.wire`: a same-host transfer is a
fast-wire transfer whose payload takes another route (its header, tags and control messages).
"""
