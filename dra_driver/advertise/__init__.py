"""Advertising: the node's devices as ResourceSlices (built, checked against the API
server's limits, tainted, published).
"""
