"""What a tensordict's transfers share: its leaves in stock order, byte layouts, tags, the fast-wire
header that describes them. Imports :mod:`cudarecv.core` and :mod:`cudarecv.cuda`.
"""
