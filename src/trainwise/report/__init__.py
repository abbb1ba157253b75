"""Rendering results for people: terminal summaries now, reports later."""

from trainwise.report.summary import render_summary

__all__ = ["render_summary"]
