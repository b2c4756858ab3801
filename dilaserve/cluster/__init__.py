"""Running the control plane against real model instances: worker processes or Ray actors."""
