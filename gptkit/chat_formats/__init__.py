"""Chat formats that are more than a line of Jinja: each a file holding its template, the special tokens it
needs and the variables it renders with; gptkit.chat_templates' BUILTIN table names them."""
