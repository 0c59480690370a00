"""Apply: give the nodes the image and the data the plan says."""
