"""The kubelet plugin: its gRPC services and the claim transaction behind them
(plan, effects, checkpoint, CDI specs, start-up reconcile and rebuild).
"""
