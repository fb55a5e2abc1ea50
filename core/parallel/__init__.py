"""The parallel layout: rank grids and process groups, the model wrapped for them, and the optimizer over them."""
