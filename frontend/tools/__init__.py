"""Builders of the demo models that `loom demo-model` trains (text and vision); not served code."""
