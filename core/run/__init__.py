"""One run from the options to the last iteration: plan, start-up checks, launch, the world, the loop and its step."""
