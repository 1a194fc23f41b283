"""The data path: datasets on the driver (:mod:`.dataset`, :mod:`.cache`), readers on the tasks (:mod:`.reader`)."""
