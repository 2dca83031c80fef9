"""``python -m botmesh_testkit.kill``: one kill loop from a shell (see
:func:`botmesh_testkit.kill.cli.main`)."""

import sys

if __name__ == "__main__":
    # Run the package's main(), so that what is pickled into the children names
    # botmesh_testkit.kill rather than __main__, and keep the children from running this
    # file again as their __main__ (multiprocess would, warning each time).
    sys.modules["__main__"].__spec__ = None
    vars(sys.modules["__main__"]).pop("__file__", None)
    from botmesh_testkit.kill import main

    sys.exit(main())
