"""The cluster API boundary: the only code that talks to the API server through the
``kubernetes`` client (reads, writes, watches of Node events).
"""
