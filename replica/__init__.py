"""The engine inside one replica: model, unified pool, adapters, scheduler and step loop."""
