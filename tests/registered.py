"""The registry's entries by defining module: which names a family module registers."""

from jaxrl_agent import registry


def defined_in(module, kinds=("estimator", "shaping", "transform")) -> dict:
    """``{name: function}`` of the entries of these kinds whose function ``module`` defines."""
    import jaxrl_agent.estimators  # noqa: F401  (registers every family)
    import jaxrl_agent.losses  # noqa: F401
    return {e.name: e.fn for kind in kinds for e in registry.entries(kind)
            if e.origin == module.__name__}
