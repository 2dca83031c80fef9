"""The built-in crash-matrix profiles (``smoke.toml``, ``full.toml``), shipped as the
data of the package ``botmesh_testkit.matrices``; ``README.md`` says what each key
means."""
