"""Features that thread through the loop, every executor and the client, one module each: what each transport
supports, round deadlines, 16-bit transfers, a client's forward-pass precision, named sites, stop signals."""
