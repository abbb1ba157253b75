"""Everything rendered for people: the terminal summary of a run, the plan's and the
doctor's views, and the run report (text, Markdown, JSON, one HTML page)."""

from trainwise.report.summary import render_summary

__all__ = ["render_summary"]
