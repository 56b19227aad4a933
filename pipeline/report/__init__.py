"""Renderers: Markdown, HTML and figures of every stage's results, one number-formatting module."""
