"""The conversion job domain: models, services, selectors, API, converters."""
