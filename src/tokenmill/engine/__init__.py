"""Request lifecycle: the step loop over scheduler and runner, detokenizing, stop checks, the async front."""
