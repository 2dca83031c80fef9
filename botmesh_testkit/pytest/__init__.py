"""The pytest integration behind :mod:`botmesh_testkit.plugin`: option values
(:mod:`.options`), the run's state and summary (:mod:`.session`), the plugin's test
items (:mod:`.items`), server provisioning (:mod:`.provisioning`), the certification
report (:mod:`.report`), the fixtures (:mod:`.fixtures`, :mod:`.kill_plugin`).

Nothing is imported here: the plugin module loads these when a hook needs them."""
