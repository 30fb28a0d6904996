"""Model definitions (pure functions of a params pytree) and checkpoint loading."""
