"""botmesh: the reference implementation, in Python asyncio, of the durable message
processing of the botmesh bot framework.

The behaviour follows the spec shipped as ``botmesh_testkit/durability.md``
(``botmesh-testkit spec``); requirement ids (``INB-3``,
``OUT-7`` ...) are cited in docstrings where the code implements them.
"""

__version__ = "0.1.0"
