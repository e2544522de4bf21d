"""Edge adaptation: hardware probe -> class -> derived overrides -> calibration."""
