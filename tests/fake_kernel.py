"""A stand-in for a Triton JIT function, for tests of the launch plans' host path on CPU: the parameter list is
all a LaunchPlan reads of the kernel (which arguments are constexprs)."""


class Param:
    def __init__(self, name, is_constexpr):
        self.name, self.is_constexpr = name, is_constexpr


class FakeKernel:
    """Parameters: one pointer, one scalar, one constexpr (FLAG)."""

    __name__ = "_fake_kernel"
    params = (Param("p0", False), Param("n", False), Param("FLAG", True))
