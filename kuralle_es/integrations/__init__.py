"""Other frameworks' agents on the journal: one module each, importing its framework
only when imported itself (``kuralle_es.integrations.pydantic_ai`` needs the
``pydantic-ai`` extra; docs/pydantic-ai.md)."""
