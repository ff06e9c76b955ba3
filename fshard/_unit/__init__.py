"""One unit (one ``fully_shard`` call): its state machine, its gradient pipeline and hooks.

Modules, lowest first (each imports only the ones above it):

- ``_grad_hooks``: the per-parameter autograd hooks (gradient arrivals, user hooks).
- ``_reduce``: a bucket's reduce-scatter (and, on 2D meshes, all-reduce) in flight.
- ``_context``: ``RootContext``, what a unit may ask of the root of its tree.
- ``_backward``: when a unit's backward is done.
- ``_group``: ``ParamGroup``, the unit's states and named transitions.
- ``_registry``: which unit a module belongs to.
- ``_module_state_dict``: a module's ``state_dict()`` / ``load_state_dict()`` on its shards.
"""
