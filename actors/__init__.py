"""Ray actors (thin shells over ``prorl_async`` objects) and the driver that wires them."""
