"""How a knob change reaches a deployment: the actuators behind the controller's ``Target``.

One module per actuator (``serve``, ``serve_llm``, ``none``, ``embedded``), the protocol
they share in :mod:`controller.backends.actuator`, and :mod:`controller.backends.registry`
to pick one by name.
"""
