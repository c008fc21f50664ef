"""The parts of the CEL environment of DRA device selectors, one module per question; the
environment itself, which uses them, is :mod:`dra_driver.scheduler.celenv` (its docstring says
what Kubernetes does, how this evaluator does it, where it differs and what each module here
holds)."""
