"""Tool calls: what a chat request's tools and tool_choice mean for its sampling (choice.py), and the calls read
back out of the model's text as it streams (hermes.py for the <tool_call> format, forced.py for calls whose shape
tool_choice enforced)."""
