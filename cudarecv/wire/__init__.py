"""What goes on a process group: the stock wire, the fast wire, control messages, staging between
host and device memory. Imports the layers below.
"""
