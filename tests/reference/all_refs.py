"""Every reference, by registry name, and the test module that compares it.

Family (a) and (c) estimators are compared in tests/test_estimators.py; the step-level family
(b) and HAE each have their own module (their batches need colliding states and extras), and
so do the shaping, re-allocation and distillation families (d), (e), (f), whose references
take the kind's arguments (a transform's reference also receives the base advantages).
"""

from tests.reference import (allocation_ref, bipace_ref, distill_ref, estimators_ref, graph_ref,
                             hae_ref, routing_ref, shaping_ref, step_ref, tree_ref)

MODULES = {
    "tests/test_estimators.py": estimators_ref.REFERENCES,
    "tests/test_step_group.py": step_ref.REFERENCES,
    "tests/test_graph_estimators.py": graph_ref.REFERENCES,
    "tests/test_tree_estimators.py": tree_ref.REFERENCES,
    "tests/test_bipace.py": bipace_ref.REFERENCES,
    "tests/test_hae.py": hae_ref.REFERENCES,
    "tests/test_shaping.py": shaping_ref.REFERENCES,
    "tests/test_allocation.py": allocation_ref.REFERENCES,
    "tests/test_routing.py": routing_ref.REFERENCES,
    "tests/test_distill.py": distill_ref.REFERENCES,
}
REFERENCES = {name: fn for refs in MODULES.values() for name, fn in refs.items()}
# Estimators with their own test module (shard invariance and layouts are tested there too).
OWN_MODULE = frozenset(REFERENCES) - frozenset(estimators_ref.REFERENCES)
