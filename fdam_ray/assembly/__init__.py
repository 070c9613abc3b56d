"""How a config becomes a running federation: the recipe (data source, executor, initial weights, resume, outputs),
the two-stage pre-training recipe, your own ``module:attr`` factories and initial weights from a file."""
