"""What a client sends of its test scores instead of the scores themselves, and what the driver reads off it:
per-class score histograms and the pooled AUC from their sums (``test_scores: histogram``)."""
