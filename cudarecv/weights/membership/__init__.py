"""Weight sync without a process group shared by all: receivers join a named sender through a store."""
