"""The engine: scheduler plus torch executor, and its asyncio face."""
