"""Usage accounting for budgets: how much of a physical GPU each prepared device holds
(:mod:`agent.usage.weights`), and the node's durable, exactly-once usage counters per claim and
device (:mod:`agent.usage.counters`)."""
