"""Production control (``slotune control``): keep the limits at the operating point on live
traffic. ``decide.py`` is the pure decision of one tick; ``store.py`` what persists between
ticks and processes (state, lease, audit log); ``loop.py`` reads windows, decides and acts."""
