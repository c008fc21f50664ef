"""A dry-run of the Kubernetes scheduler's structured allocator (resource.k8s.io/v1) that says
why a ResourceClaim does or does not fit a node's devices.

- ``domain``: the domain types, parsed and validated from API dicts (``InputError`` names the
  offending field path);
- ``celenv`` (with its parts in the package ``cel``): the CEL environment of device selectors;
- ``candidates``: per-request candidates; ``capacity``: counters, consumable capacity and
  request policies; ``constraints``: matchAttribute and distinctAttribute; ``search``: the
  backtracking search (``picking``: its rules for shares, repeats, a pod's claims and the
  limit); ``outcome``: what the search answers; ``joint``: a pod's claims searched together
  (``explain_pod``);
- ``explanation``: the facade (``explain(...)`` returns an ``Explanation``) and its text and JSON;
  ``node_read``: the classes, slices and allocated claims as the modelled scheduler reads them;
  ``allocated``: what other claims hold; ``allocation_config``: an allocation's ``devices.config``;
- ``inputs``: what the CLI reads, without I/O; ``node_reach``: which slices a node sees, and the
  nodeSelector an allocation gets;
- ``versions``: the scheduler modelled (Kubernetes 1.34 or 1.35, its DRA feature gates and the
  allocator variant they pick), ``slice_layout``: how that version reads counter sets,
  ``gates``: what a gate that is off does to a claim.

The rules are those of k8s.io/dynamic-resource-allocation ``structured/internal/incubating``
(the variant the scheduler uses when any of the newer DRA features is on) of the version
``versions`` models; each module cites the files it follows.

Nothing is imported here: the CEL libraries ``explain`` needs cost 0.3 s to import, which
``inputs`` (read by the CLI before it knows it will allocate) must not pay.
"""
