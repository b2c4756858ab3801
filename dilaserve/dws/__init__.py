"""The Denoising Surface (DWS): prompt-only cost prediction."""
