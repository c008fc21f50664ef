"""A kubelet for tests and debugging (``tessera kubelet ...``, the benchmarks): a client
of the plugin's sockets and the kubelet's plugin manager. The agent never imports it.
"""
