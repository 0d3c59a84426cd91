"""kvasync's benchmark, ``python -m kvasync.bench`` (``--help`` for the options).

Layout (data, measuring and rendering apart, dependencies pointing one way):

- ``__main__``: the command line and the section loop;
- ``common``: rows, run options, units, targets (no GPU import; what a saved run needs);
- ``context``: the device pool, offloaders per page size, the measured ceilings (the only
  module that touches CUDA or kvasync internals);
- ``sections/``: one module per family of measurements;
- ``report``: tables and the target summary; ``plot``: figures (matplotlib optional).
"""

__all__: list[str] = []
