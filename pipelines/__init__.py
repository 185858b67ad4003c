"""Kubeflow pipelines of peagle (KFP v2). ``peagle_pipeline.build_pipeline(profile)`` is the one pipeline."""
