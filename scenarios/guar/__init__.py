"""The GUAR table of the spec as runnable scenarios, one file per row
(:mod:`botmesh_testkit.scenario` is the API). They run against every backend given with
``--botmesh-backend``; read them as examples for scenarios of one's own."""
