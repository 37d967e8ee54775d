"""``python -m app.config``: print the settings table as Markdown."""

from app.config.table import render_settings_table

print(render_settings_table())
