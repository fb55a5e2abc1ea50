"""Memory per GPU before launch: the estimate, the check against the GPU, and the search for layouts that fit."""
