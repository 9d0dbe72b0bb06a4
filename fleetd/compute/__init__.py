"""Devices, buffers, tensor views, graph plans and the op table."""
