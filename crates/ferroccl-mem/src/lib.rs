//! FerroCCL's memory boundary (in progress).
